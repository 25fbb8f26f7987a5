"""Environment: what decides compiled-artifact reuse. The lock snapshot (lock), its diff (diff),
the package-list formats diff reads (formats) and inductor's system key computed without waking
CUDA (systemkey). Torch build facts live one floor down (compilewatch.torchinfo): cache/ reads them too.
"""
