"""Results on disk: the record format (`records`, `environment`), run directories (`store`), the index over
them (`index`) and exports for other tools (`export`)."""
