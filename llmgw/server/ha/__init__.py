"""High availability: the leader's lease on PostgreSQL, and the standby that answers reads meanwhile."""
