"""The networks: the DFlash drafter, its attention masks, its loss, the chunked head + CE, the frozen
target it reads hidden states from, and the drafter a config builds. No data, no loop."""
