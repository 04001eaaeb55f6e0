"""Measuring one (case, implementation): the pair measurement (`pair`, and `rank` for each rank of a
distributed one), timing, memory, FLOPs, the float64 oracle (`reference`), the environment and calibration.
"""
