"""The rollout controller: replacing outdated replicas, staging their new weights ahead."""
