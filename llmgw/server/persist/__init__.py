"""The server's persistence: every line of SQL, for sqlite and PostgreSQL, and nothing else."""
