"""The health controller: judging each replica's current attempt from what its agents observe."""
