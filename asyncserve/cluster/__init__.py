"""Cluster mode's logic as plain classes: load digests, peer authentication, membership, routing,
adapter placement and migration planning. The server's cluster actor and scripts/simulate_cluster.py
both drive these; nothing here does I/O except membership's injectable DNS resolver."""
