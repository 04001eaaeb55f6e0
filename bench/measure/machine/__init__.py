"""The machine a pair runs on: its environment and identity, hardware datasheets, NVML, the calibrated rates,
contention, the node topology."""
