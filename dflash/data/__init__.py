"""Conversations to tokens: reading and checking chat data, the assistant loss mask, the memory-mapped
tokenized-data cache, regeneration by the target, and the training data of a config."""
