//! cq
