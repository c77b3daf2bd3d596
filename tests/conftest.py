pytest_plugins = ["datapath.testing"]
