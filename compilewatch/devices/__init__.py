"""Devices: device specs (spec), GPU sampling and the imbalance rule (gpus), sequential prewarm of
every device (warm), the compile probe of a device (probe) and the hand-off to the training command
(handoff).
"""
