"""`kava-ray bench ...`: side-by-side measurements that call the production code paths."""
