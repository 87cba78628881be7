"""The files calque reads at run time, found through this package (importlib.resources) wherever calque is: the
cost model's rates.json, and in sdist/ the build files an EC2 worker's copy of calque is installed with
(calque.kit_archive). In a checkout each is a link to the file at the top of the tree; an install holds copies."""
