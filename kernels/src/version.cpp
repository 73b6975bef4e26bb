// Placeholder translation unit: the kernels issue replaces this library's sources.
extern "C" int kt_abi_version() { return 1; }
