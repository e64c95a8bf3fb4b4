"""What a long segment costs a p2p stage in memory: sends waited on as received against held."""
