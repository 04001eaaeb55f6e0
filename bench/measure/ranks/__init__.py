"""One rank of a distributed pair: its measurement, its part of the record, the record assembled from the parts."""
