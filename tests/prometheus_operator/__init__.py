"""The Prometheus Operator's CRDs (monitoring.coreos.com), generated from its published API types
by build.py, for the real Kubernetes tier's test of the shipped monitoring objects."""
