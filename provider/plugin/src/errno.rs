//! errno
