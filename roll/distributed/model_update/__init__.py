"""Model update: trainer weights -> inference engines (buckets, transports, groups, probe)."""
