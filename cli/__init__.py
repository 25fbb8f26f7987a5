"""Typer apps for `compilewatch` and `dflash`: parse arguments, call the library, render results."""
