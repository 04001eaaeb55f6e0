"""What to measure: suite files (`suite`) validated and expanded into cases (`case`)."""
