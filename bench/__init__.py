"""The benchmark harness behind `h3gen bench`, and scripts for digging on a GPU."""
