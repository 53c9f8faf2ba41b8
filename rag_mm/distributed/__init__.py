"""The distributed glue: process-group start-up (env) and the reader spread over the ranks
(spread)."""
