"""Deployments of plait on serving platforms: `plait.deploy.ray` (Ray Serve, `plait[ray]`)."""
