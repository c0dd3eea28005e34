"""The server's HTTP edge: the router and one module per resource of the API."""
