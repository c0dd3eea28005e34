"""The controllers: each decides on the cluster's state and changes it only through its verbs."""
