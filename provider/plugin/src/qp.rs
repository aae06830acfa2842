//! qp
