"""pcp-launch: Paddle's elastic launch, with a crash loop stopped and its etcd client importable."""
