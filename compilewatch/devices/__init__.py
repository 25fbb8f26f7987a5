"""Devices: device specs (spec), GPU sampling and the imbalance rule (gpus), sequential prewarm of
every device (warm) and the hand-off to the training command (handoff).
"""
