"""The key-value stores the job meets through: the Redis-backed torch Store and the control store (JSON
values for the driver and its executors). Below both parallel/ and resilience/, which use them."""
