//! interpose
