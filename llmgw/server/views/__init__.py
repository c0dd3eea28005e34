"""What the cluster shows: plain functions over its state for the admin API, the feed and the agents."""
