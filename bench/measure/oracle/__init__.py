"""The float64 oracle and what is judged against it: the reference attention, the output and gradient check, numerics
against a same-dtype reference, a selection's fidelity, attention statistics."""
