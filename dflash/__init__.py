"""dflash: a DFlash (block-diffusion speculative decoding) drafter trainer built on compilewatch."""

__version__ = "0.1.0"
