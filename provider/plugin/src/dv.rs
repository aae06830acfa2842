//! `stagdv.h`: the RFC 7306 and Commit operations verbs has no words for.
