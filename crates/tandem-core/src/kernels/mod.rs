//! CPU kernels. Each one sits next to its plain reference (or a second formulation of the
//! same maths) and a test that holds the two together.

pub mod attention;
pub mod deltanet;
pub mod matmul;
pub mod norm;
pub mod rope;
