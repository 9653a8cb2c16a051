"""The real servers tests and benchmarks run against, started on 127.0.0.1 in private
directories and stopped by their caller: SeaweedFS (S3), PostgreSQL, a Spark standalone
cluster, ``dagster dev`` with a GraphQL client, and headless Chromium on the Dagster UI."""
