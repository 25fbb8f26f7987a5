"""Every miss explained by the parts of its key that changed.

A miss is compared with the records before it, closest first:
0. the same key missed just before in the same process and run: its entry was not written yet (threads
   compiling one graph at once: `probe --threads`) or torch did not save it;
1. the same key recorded before in this store: the key did not change, the entry is gone (cleared,
   pruned, evicted) or its shape guards did not pass;
2. the same key recorded in another store of the same parent folder: the cache dir moved;
3. entries of the same graph code (same forward/backward), else of the same compiled function: the one
   with the fewest differing parts (the newest on a tie) is "before", and the differing parts are
   named, worst cause first (compilewatch.explain.parts.rank: a torch build before an environment
   variable before a setting before inductor config before inputs before the code);
4. nothing close: "new graph: no entry of this code or name".
An AOTAutograd miss (torch keeps no parts for it) takes the cause of the FX-graph miss of the same
compile, or rules 1-2. A part whose value was not recorded says so (its digests are shown).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from compilewatch.explain import envmap
from compilewatch.explain import parts as P
from compilewatch.explain import store as S


@dataclass(frozen=True, slots=True)
class Diff:
    part: str  # torch's name, e.g. inductor_config[max_autotune]
    words: str  # the same in plain words
    before: str | None  # None: not recorded
    after: str | None
    text: str
    risk: bool = False  # a difference that did not change torch's key here (an environment variable): named last


@dataclass(frozen=True, slots=True)
class Explanation:
    kind: str  # fxgraph | aotautograd
    key: str
    name: str | None
    backward: bool | None
    compile_id: str | None
    verdict: str  # changed | not_saved | entry_gone | moved | new_graph | not_recorded
    cause: str  # the first-named cause, used to group misses
    diffs: tuple[Diff, ...]
    text: str
    compared_with: str | None = None  # the key of the entry compared with


@dataclass(frozen=True, slots=True)
class Cause:
    cause: str
    misses: int
    example: str


@dataclass(frozen=True, slots=True)
class CompileTime:
    """Where one watched process's compile time went (compilewatch.explain.timing), worst phase first."""

    pid: int
    torch: str | None
    warm: bool  # every cache lookup of the process hit
    total_s: float  # the time a timed compile step was open, summed over threads
    wall_s: float
    threads: int
    phases: dict[str, float]  # phase -> seconds, worst first ("other" last)
    unavailable: tuple[str, ...]  # phases this torch does not time
    unmeasured: tuple[str, ...]  # torch steps of an available phase that this torch does not time
    top: tuple[tuple[str, str, float, int], ...]  # (torch's event, phase, own seconds, count), worst first
    text: str


@dataclass(frozen=True, slots=True)
class RunExplanation:
    store: str
    cache_dir: str
    run: str | None
    pids: tuple[int, ...]
    when: float | None
    lookups: int
    hits: int
    misses: int
    hit_rate: float | None
    explanations: tuple[Explanation, ...]
    causes: tuple[Cause, ...]  # grouped, worst first
    warnings: tuple[str, ...] = ()
    compile_times: tuple[CompileTime, ...] = ()  # per watched process (issue 38, part 4: warm but slow)


@dataclass(slots=True)
class _Pool:
    """The records one explanation may look at: this store's and its siblings'."""

    own: S.StoreData
    siblings: list[S.StoreData] = field(default_factory=list)


def _label(rec: dict) -> str:
    fb = " backward" if rec.get("backward") else (" forward" if rec.get("backward") is False else "")
    return f"{rec.get('name') or 'graph'}{fb}"


def _show(v: str | None, digest: str) -> str:
    return v if v is not None else f"[{digest[:8] or '?'}]"


def diff_parts(before: dict[str, list], after: dict[str, list]) -> list[Diff]:
    """The parts that differ, worst cause first."""
    env_known = P.ENV_MARK in before and P.ENV_MARK in after
    out: list[Diff] = []
    for name in sorted(set(before) | set(after), key=lambda n: (P.rank(n), n)):
        if name == P.ENV_MARK:
            continue
        a, b = before.get(name), after.get(name)
        if a is not None and b is not None:
            same = a[1] == b[1] if (not a[0] or not b[0]) else a[0] == b[0]
            if same:
                continue
            w = P.words(name)
            if a[1] is None or b[1] is None:
                text = f"{w} changed (value not recorded: {_show(a[1], a[0])} → {_show(b[1], b[0])})"
            elif a[1] == b[1]:
                text = f"{w} changed beyond what is recorded ({a[1]}; digests {a[0][:8]} → {b[0][:8]})"
            else:
                text = f"{w} {a[1]} → {b[1]}"
            out.append(Diff(name, w, a[1], b[1], text))
        elif name.startswith("env["):
            if not env_known:
                continue
            w = P.words(name)
            out.append(Diff(name, w, a[1] if a else "unset", b[1] if b else "unset",
                            f"{w} {_show(a[1], a[0]) if a else 'unset'} → {_show(b[1], b[0]) if b else 'unset'}"))
        else:
            w = P.words(name)
            out.append(Diff(name, w, a[1] if a else None, b[1] if b else None,
                            f"{w}: recorded on one side only ({'not recorded' if a is None else _show(a[1], a[0])} → "
                            f"{'not recorded' if b is None else _show(b[1], b[0])})"))
    return _env_risks(_inputs_as_one(before, after, out))


def _inputs_as_one(before: dict[str, list], after: dict[str, list], diffs: list[Diff]) -> list[Diff]:
    """When the number of inputs changed (dynamic shapes add a symbolic size input in front), inputs
    compared position by position pair unrelated things: name the input lists instead, as one part."""
    ins_b = sorted((n for n in before if n.startswith("example_inputs[")), key=_index)
    ins_a = sorted((n for n in after if n.startswith("example_inputs[")), key=_index)
    if not ins_b or not ins_a or len(ins_b) == len(ins_a):
        return diffs

    def listed(parts: dict[str, list], names: list[str]) -> str:
        shown = ", ".join(_show(parts[n][1], parts[n][0]) for n in names[:4])
        return f"{len(names)} input{'s' if len(names) != 1 else ''} ({shown}{', ...' if len(names) > 4 else ''})"

    b, a = listed(before, ins_b), listed(after, ins_a)
    sym_b, sym_a = _symbolic(before, ins_b), _symbolic(after, ins_a)
    why = " (sizes became symbolic: dynamic shapes)" if sym_a and not sym_b else \
        " (sizes became static)" if sym_b and not sym_a else ""
    one = Diff("example_inputs[*]", "inputs", b, a, f"inputs {b} → {a}{why}")
    rest = [d for d in diffs if not d.part.startswith("example_inputs[")]
    at = next((i for i, d in enumerate(rest) if P.rank(d.part) > P.rank(one.part)), len(rest))
    return rest[:at] + [one] + rest[at:]


def _index(name: str) -> int:
    inner = name[len("example_inputs["):].rstrip("]")
    return int(inner) if inner.isdigit() else 1 << 30


def _symbolic(parts: dict[str, list], names: list[str]) -> bool:
    return any(P.is_symbolic(parts[n][1] or "") for n in names)


def _env_risks(diffs: list[Diff]) -> list[Diff]:
    """An environment variable is compilewatch's own record, not a part of torch's key: it is a cause only
    through a setting, config flag or compile option it sets. When none of those differs (or only those
    that another variable names), a differing variable did no harm here: named last, as a risk."""
    env = [d for d in diffs if d.part.startswith("env[")]
    rest = [d for d in diffs if not d.part.startswith("env[")]
    if not env or not rest:
        return diffs
    settable = [d for d in rest if 4 <= P.rank(d.part) <= 6]
    read_by = envmap.inductor_env_map()  # flag -> the variables torch's config source reads for it

    def sets(e: Diff, d: Diff) -> bool:
        return P.env_sets(e.part, d.part) or P.env_name(e.part) in read_by.get(P.config_flag(d.part), ())

    linked = {e.part for e in env if any(sets(e, d) for d in settable)}
    # a flag torch's source does not map (a compile option, another torch's flag) may be set by any variable
    unexplained = [d for d in settable if not any(sets(e, d) for e in env) and P.config_flag(d.part) not in read_by]
    if unexplained:  # a variable may set it under another name: each may be the cause
        return diffs
    risks = [Diff(e.part, e.words, e.before, e.after, f"{e.text} (a risk, not this miss's cause: no setting, config "
                  f"flag or compile option it could set differs)", risk=True) for e in env if e.part not in linked]
    return [d for d in diffs if not (d.part.startswith("env[") and d.part not in linked)] + risks


def _cause_of(d: Diff) -> str:
    if d.part.startswith("example_inputs["):
        return "input dtype/shape/stride/device"
    return d.words


def _summary_text(rec: dict, diffs: list[Diff]) -> str:
    shown = "; ".join(d.text for d in diffs[:3])
    rest = len(diffs) - min(3, len(diffs))
    tail = f"; {rest} other part{'s' if rest != 1 else ''} differ{'s' if rest == 1 else ''}" if rest else \
        f"; 0 other parts differ" if len(diffs) == 1 else ""
    return f"cache miss {_label(rec)} ({rec.get('kind')}): {shown}{tail}"


def _still_running(other: dict, rec: dict, own: S.StoreData) -> bool:
    """Whether the process of the lookup `other` recorded something (a later lookup, its compile-time line,
    written when its watch ended) after `rec` was looked up: it was alive, maybe compiling that graph."""
    who, t = (other.get("pid"), other.get("run")), rec.get("t")
    if t is None or who == (rec.get("pid"), rec.get("run")):
        return False
    return any((x.get("pid"), x.get("run")) == who and (x.get("t") or 0) > t for x in own.lookups + own.timings)


def explain_miss(rec: dict, index: int, pool: _Pool) -> Explanation:
    own = pool.own
    before = own.lookups[:index]
    key, kind = rec["key"], rec.get("kind", "fxgraph")
    base = dict(kind=kind, key=key, name=rec.get("name"), backward=rec.get("backward"), compile_id=rec.get("compile_id"))
    same = [r for r in before if r["key"] == key and r.get("kind") == kind]
    if same and not same[-1].get("hit") and same[-1].get("pid") == rec.get("pid") and same[-1].get("run") == rec.get("run"):
        ago = max(0.0, float(rec.get("t") or 0) - float(same[-1].get("t") or 0))
        text = (f"cache miss {_label(rec)} ({kind}): the same key missed {ago:.1f} s before in this process: its entry was "
                f"not written yet (another thread compiling the same graph at the same time), or torch did not save it")
        return Explanation(**base, verdict="not_saved", cause="same key missed before in this process (not saved yet)",
                           diffs=(), text=text, compared_with=key)
    if same and not same[-1].get("hit") and _still_running(same[-1], rec, own):
        r = same[-1]
        ago = max(0.0, float(rec.get("t") or 0) - float(r.get("t") or 0))
        text = (f"cache miss {_label(rec)} ({kind}): process {r.get('pid')} (run {r.get('run')}) missed the same key "
                f"{ago:.1f} s before and was still running: its entry was not written yet (two processes compiling "
                f"the same graph at the same time), or torch did not save it")
        return Explanation(**base, verdict="not_saved", cause="same key being compiled by another process at the "
                           "same time (not saved yet)", diffs=(), text=text, compared_with=key)
    if same:
        r = same[-1]
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.get("t", 0)))
        text = (f"cache miss {_label(rec)} ({kind}): same key recorded at {when}, nothing in the key changed: its entry "
                f"is gone from {rec.get('cache_dir')} (cleared, pruned or evicted) or its shape guards did not pass")
        return Explanation(**base, verdict="entry_gone", cause="entry gone from the cache (same key)", diffs=(),
                           text=text, compared_with=key)
    t = rec.get("t", float("inf"))
    for sib in pool.siblings:
        hit = [r for r in sib.lookups if r["key"] == key and r.get("kind") == kind and r.get("t", 0) < t]
        if hit:
            old = hit[-1].get("cache_dir") or str(S.cache_dir_of(sib.path))
            d = Diff("cache dir", "cache dir", old, rec.get("cache_dir"), f"cache dir {old} → {rec.get('cache_dir')}")
            text = (f"cache miss {_label(rec)} ({kind}): {d.text} (the same key was recorded there: the cache dir "
                    f"moved, or TORCHINDUCTOR_CACHE_DIR points elsewhere); 0 other parts differ")
            return Explanation(**base, verdict="moved", cause="cache dir moved", diffs=(d,), text=text, compared_with=key)
    after = own.parts_of(rec)
    if kind == "aotautograd" or not after:
        fx = [r for r in own.lookups[index + 1:index + 40] + own.lookups[max(0, index - 40):index]
              if r.get("kind") == "fxgraph" and not r.get("hit") and r.get("compile_id") == rec.get("compile_id")
              and r.get("run") == rec.get("run") and r.get("pid") == rec.get("pid")]
        if fx:
            j = own.lookups.index(fx[0])
            inner = explain_miss(fx[0], j, pool)
            return Explanation(**base, verdict=inner.verdict, cause=inner.cause, diffs=inner.diffs,
                               text=f"cache miss {_label(rec)} ({kind}, parts from its FX graph): "
                                    f"{inner.text.split(': ', 1)[-1]}",
                               compared_with=inner.compared_with)
        return Explanation(**base, verdict="not_recorded", cause=f"{kind} key parts not recorded", diffs=(),
                           text=f"cache miss {_label(rec)} ({kind}): the key's parts were not recorded, so the change "
                                f"cannot be named")
    gm = (after.get("gm") or [None])[0]

    def candidates(data: S.StoreData, limit: int | None) -> tuple[list[dict], list[dict]]:
        rs = data.lookups[:limit] if limit is not None else [r for r in data.lookups if r.get("t", 0) < t]
        rs = [r for r in rs if r.get("kind") == kind and r.get("backward") == rec.get("backward")]
        by_code = [r for r in rs if gm and (data.parts_of(r) or {}).get("gm", [None])[0] == gm]
        by_name = [r for r in rs if rec.get("name") and r.get("name") == rec.get("name")]
        return by_code, by_name

    found: list[tuple[S.StoreData, dict]] = []
    for data, limit in [(own, index)] + [(s, None) for s in pool.siblings]:
        by_code, by_name = candidates(data, limit)
        if by_code or by_name:
            found = [(data, r) for r in (by_code or by_name)]
            break
    if not found:
        return Explanation(**base, verdict="new_graph", cause="new graph", diffs=(),
                           text=f"cache miss {_label(rec)} ({kind}): new graph: no entry of this code or name")
    best = None
    for i, (data, r) in enumerate(found):
        bp = data.parts_of(r)
        if bp is None:
            continue
        diffs = diff_parts(bp, after)
        score = (len(diffs), -i)
        if best is None or score < best[0]:
            best = (score, r, diffs)
    if best is None:
        return Explanation(**base, verdict="not_recorded", cause="parts of the closest entry not recorded", diffs=(),
                           text=f"cache miss {_label(rec)} ({kind}): the closest entries' parts are missing from the store")
    _, r, diffs = best
    if not diffs:
        return Explanation(**base, verdict="not_recorded", cause="a part compilewatch does not record", diffs=(),
                           text=f"cache miss {_label(rec)} ({kind}): every recorded part equals entry {r['key'][:12]}'s, "
                                f"yet the key differs: a part torch does not print changed", compared_with=r["key"])
    return Explanation(**base, verdict="changed", cause=_cause_of(diffs[0]), diffs=tuple(diffs),
                       text=_summary_text(rec, diffs), compared_with=r["key"])


def group_causes(expls: list[Explanation]) -> tuple[Cause, ...]:
    by: dict[str, list[Explanation]] = {}
    for e in expls:
        by.setdefault(e.cause, []).append(e)
    order = sorted(by.items(), key=lambda kv: (-len(kv[1]), P.rank(kv[1][0].diffs[0].part) if kv[1][0].diffs else 9))
    return tuple(Cause(c, len(es), next((e for e in es if e.kind == "fxgraph"), es[0]).text) for c, es in order)


def _load_pool(cache_dir: str | os.PathLike[str], *, must_exist: bool = False) -> tuple[_Pool, list[str]]:
    own = S.read(S.store_dir(cache_dir), must_exist=must_exist)
    warnings = []
    sibs = []
    for p in S.sibling_stores(cache_dir):
        try:
            sibs.append(S.read(p))
        except Exception as e:  # noqa: BLE001 - an untrusted sibling is left out, and said so
            warnings.append(f"left out {p}: {getattr(e, 'message', e)}")
    for d in [own] + sibs:
        if d.newer:
            warnings.append(f"{d.path}: {d.newer} record(s) of a newer format left out (a newer compilewatch wrote them)")
        if d.skipped:
            warnings.append(f"{d.path}: {d.skipped} line(s) that do not parse or do not have the store's format "
                            f"left out")
    return _Pool(own, sibs), warnings


def explain_run(cache_dir: str | os.PathLike[str], *, run: str | None = None, pids: tuple[int, ...] | None = None,
                must_exist: bool = False) -> RunExplanation:
    """The lookups of one run on `cache_dir` (default: the last run recorded there), misses explained."""
    cache_dir = str(Path(os.path.abspath(cache_dir)))
    pool, warnings = _load_pool(cache_dir, must_exist=must_exist)
    looks = pool.own.lookups
    if must_exist and not looks:
        from compilewatch.errors import BadInput

        left = "".join(f"; {n} line(s) {why} left out" for n, why in (
            (pool.own.skipped, "that do not parse or do not have the store's format"),
            (pool.own.newer, "of a newer format")) if n)
        raise BadInput(f"the key store {pool.own.path} records no cache lookups{left}: its {S.FILE} is missing, "
                       f"empty or unreadable",
                       hint="run the program under `compilewatch run -- ...` (or compilewatch.watch()) again to record "
                            f"its lookups; a damaged store can be removed (rm -r {pool.own.path})")
    if run is None and pids:
        mine = [r for r in looks if r.get("pid") in pids]
        run = mine[-1].get("run") if mine else None
    elif run is None and looks:
        run = looks[-1].get("run")
    idx = [i for i, r in enumerate(looks) if run is not None and r.get("run") == run
           and (not pids or r.get("pid") in pids)]
    expls = [explain_miss(looks[i], i, pool) for i in idx if not looks[i].get("hit")]
    hits = sum(1 for i in idx if looks[i].get("hit"))
    return RunExplanation(str(pool.own.path), cache_dir, run, tuple(sorted({looks[i].get("pid", 0) for i in idx})),
                          looks[idx[-1]].get("t") if idx else None, len(idx), hits, len(idx) - hits,
                          round(hits / len(idx), 4) if idx else None, tuple(expls), group_causes(expls), tuple(warnings),
                          compile_times(pool.own, run, pids))


def compile_time(rec: dict) -> CompileTime:
    """A store's `timing` line in words (compilewatch.explain.timing)."""
    from compilewatch.explain import timing as T

    raw = {p: float(v) for p, v in (rec.get("phases") or {}).items() if isinstance(v, (int, float))}
    phases = dict(sorted(((p, v) for p, v in raw.items() if p != T.OTHER), key=lambda kv: -kv[1]))
    if T.OTHER in raw:
        phases[T.OTHER] = raw[T.OTHER]
    looks = rec.get("lookups") or {}
    warm = bool(looks.get("hit")) and not looks.get("miss")
    top = tuple((str(e[0]), str(e[1]), float(e[2]), int(e[3])) for e in rec.get("top") or ()
                if isinstance(e, list) and len(e) == 4)
    return CompileTime(int(rec.get("pid", 0)), rec.get("torch"), warm, float(rec.get("total_s") or 0),
                       float(rec.get("wall_s") or 0), int(rec.get("threads") or 0), phases,
                       tuple(rec.get("unavailable") or ()), tuple(rec.get("unmeasured") or ()), top,
                       T.line(rec, warm=warm))


def compile_times(data: S.StoreData, run: str | None, pids: tuple[int, ...] | None) -> tuple[CompileTime, ...]:
    last: dict[int, dict] = {}
    for t in data.timings:
        if run is not None and t.get("run") == run and (not pids or t.get("pid") in pids):
            last[t.get("pid", 0)] = t
    return tuple(compile_time(t) for _, t in sorted(last.items()))


def explain_report(path: str | os.PathLike[str]) -> list[RunExplanation]:
    """The runs a saved watch report (`compilewatch run --report`, `compilewatch.watch(report=)`) recorded."""
    from compilewatch.errors import BadInput
    from compilewatch.inputs import loads_json, one_line, read_text

    text = read_text(path, what="report")
    seen: dict[tuple[str, str], set[int]] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        ev = loads_json(line, f"{path} line {n}")
        if not isinstance(ev, dict):
            raise BadInput(f"{path} line {n}: not a watch event (a JSON object)",
                           hint="give a report written by `compilewatch run --report FILE`")
        if ev.get("kind") != "cache_lookups":
            continue
        d = ev["detail"] if isinstance(ev.get("detail"), dict) else ev  # a report's lines hold the detail flat
        pid, stores = ev.get("pid", 0), d.get("stores") or []
        bad = "its pid is not an integer" if not isinstance(pid, int) or isinstance(pid, bool) else \
            "its stores are not a list" if not isinstance(stores, list) else \
            next((f"store {one_line(st, 120)} is not a compilewatch key store's path (<dir>/.<cache dir name>{S.SUFFIX})"
                  for st in stores if not isinstance(st, str) or not _is_store_path(st)), None)
        if bad:
            raise BadInput(f"{path} line {n}: a cache_lookups event, but {bad}",
                           hint="give a report written by `compilewatch run --report FILE`")
        for st in stores:
            if isinstance(d.get("run"), str):
                seen.setdefault((st, d["run"]), set()).add(pid)
    if not seen:
        raise BadInput(f"{path} records no cache lookups",
                       hint="the program made no FX-graph / AOTAutograd cache lookup (it compiled nothing "
                            "with inductor), or an older compilewatch wrote it, before lookups were recorded; "
                            "run it again under `compilewatch run --report FILE -- ...`")
    runs = [explain_run(S.cache_dir_of(Path(st)), run=run, pids=tuple(pids), must_exist=True)
            for (st, run), pids in sorted(seen.items())]
    if not any(r.lookups for r in runs):  # the store was compacted, removed or recreated since the report
        raise BadInput(f"{path}: the key store(s) it names hold no lookups of its run(s) "
                       f"({', '.join(sorted({one_line(r.run, 80) for r in runs}))}): they were compacted away, or the "
                       f"store was removed and made again since",
                       hint="explain the last run on the cache dir instead (`compilewatch cache explain --dir DIR`), "
                            "or run the program again under `compilewatch run --report FILE -- ...`")
    return [r if r.lookups else replace(r, warnings=r.warnings + (
        f"{r.store} holds no lookups of run {r.run} any more (compacted away, or the store was made again)",))
        for r in runs]


def _is_store_path(st: str) -> bool:
    name = Path(st).name
    return os.path.isabs(st) and name.startswith(".") and name.endswith(S.SUFFIX) and len(name) > len(S.SUFFIX) + 1


def last_run_line(cache_dir: str | os.PathLike[str]) -> tuple[str, str] | None:
    """doctor's line: (level, message) about the last watched run on `cache_dir`, or None when none is recorded."""
    try:
        r = explain_run(cache_dir)
    except Exception as e:  # noqa: BLE001 - doctor never raises for what it finds
        return ("warn", f"cache key records: {getattr(e, 'message', e)}")
    if not r.lookups:
        return None
    ago = max(0.0, time.time() - (r.when or time.time()))
    top = f"; top miss cause: {r.causes[0].cause} ({r.causes[0].misses} miss{'es' if r.causes[0].misses != 1 else ''})" \
        if r.causes else ""
    slow = ""
    if r.compile_times:  # the slowest process: its compile time and where most of it went
        ct = max(r.compile_times, key=lambda c: c.total_s)
        worst = next(((p, v) for p, v in ct.phases.items() if v > 0), None)
        slow = f"; {'warm ' if ct.warm else ''}compile time {ct.total_s:.2f} s" + \
            (f", most in {worst[0]} ({worst[1]:.2f} s)" if worst else "")
    return ("info", f"last watched run on this cache ({ago / 60:.0f} min ago): {r.hits}/{r.lookups} cache lookups hit "
                    f"({100 * (r.hit_rate or 0):.0f}%){top}{slow} (`compilewatch cache explain`)")
