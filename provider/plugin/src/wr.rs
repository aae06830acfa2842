//! wr
