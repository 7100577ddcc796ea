"""AWS's EC2 metadata mock (github.com/aws/amazon-ec2-metadata-mock), built from its Go module by
build.py, that the node agent's AWS spot notice is tested against (tests/test_reclaim_watch.py)."""
