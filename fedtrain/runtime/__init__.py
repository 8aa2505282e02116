"""Network drivers: the gRPC aggregation server, site daemons and their mutual-TLS setup."""
