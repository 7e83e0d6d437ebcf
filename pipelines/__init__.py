"""The Kubeflow Pipelines DAG: compile, version, submit, local runner and CLI."""
