"""On-device kernels and their verification (the template: ``verified``); a new kernel goes here, with its checks,
behind the guard."""
