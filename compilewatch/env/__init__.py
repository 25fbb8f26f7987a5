"""Environment: what decides compiled-artifact reuse. The lock snapshot (lock), its diff (diff),
the package-list formats diff reads (formats), torch build facts (torchinfo) and inductor's system
key computed without waking CUDA (systemkey).
"""
