"""dflash.check: will an export serve as it was trained? (`dflash check`, issue 40)

What it holds:
- `record`: what an export records at save about what it was trained with (the target tokenizer's
  vocabulary and special tokens, the chat template, its rendering of one fixed conversation, the
  generation prompt, thinking on/off, the trained DFlash fields), written by
  dflash.checkpoint.store into config.json's `dflash_training`, and the same facts read from a
  target now.
- `serving`: the config.json fields SGLang's and vLLM's DFlash loaders read, and what they would
  ignore, reject or read with another default.
- `static`: the static checks (export against target, training record against the target's
  tokenizer and template now, the serving fields), each a `Finding`.
- `measure`: measured acceptance on prompts (τ per prompt and overall, by block position, the
  prompts far below the rest, the training-time estimate beside it, what explains a gap).
- `check`: `check_export`, the one entry (`dflash.check` in the public face), and `CheckReport`.

What it may import: dflash.config, dflash.model, dflash.data, dflash.checkpoint, dflash.eval and
compilewatch's public API. Never dflash.training, dflash.run, dflash.engine, dflash.distributed or
cli. dflash.checkpoint.store imports `record` (lazily, at save) and nothing else from here.
"""
