//! rdma_cm for the userspace device: librdmacm's API, mapped onto MPA
//! connections of stag0 (its addresses are TCP addresses).
