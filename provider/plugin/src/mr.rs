//! mr
