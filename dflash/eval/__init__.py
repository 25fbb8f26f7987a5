"""Measuring a drafter: the reference speculative-decoding loop, acceptance length τ and speedup."""
