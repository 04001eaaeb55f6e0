"""A case made ready for an implementation: its inputs and steps, the staged selection or paged pool, the prepared
call, the pattern cache shared by a case's implementations, the FLOP and byte counts."""
