"""What the farm exports for monitoring: the Prometheus series of the API and the farm-wide ones read from Redis
at scrape time (`prometheus`)."""
