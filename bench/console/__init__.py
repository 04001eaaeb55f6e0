"""Printing: one way to format times, bytes and rates (`format`) and one way to make a terminal console
(`terminal`). Everything that prints to a terminal or renders a figure formats through these."""
