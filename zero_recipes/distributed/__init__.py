"""A rank among others: launcher env, rendezvous port, process group start to exit, log filter, lost peers, stops."""
