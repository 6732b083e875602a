//! A small command-line parser: `--name value`, `--name=value` and boolean `--flag`s, with
//! errors that name the flag. (Enough for tandem's subcommands without a parser dependency.)

use std::collections::HashMap;
use std::str::FromStr;

use anyhow::{bail, Context, Result};

pub struct Args {
    values: HashMap<String, String>,
    flags: Vec<String>,
}

impl Args {
    /// Parse `argv` given the names of the options that take a value and of the boolean flags.
    pub fn parse(argv: &[String], with_value: &[&str], booleans: &[&str]) -> Result<Args> {
        let mut values = HashMap::new();
        let mut flags = Vec::new();
        let mut it = argv.iter();
        while let Some(a) = it.next() {
            let Some(name) = a.strip_prefix("--") else {
                bail!("unexpected argument {a:?} (options start with --; see --help)");
            };
            let (name, inline) = match name.split_once('=') {
                Some((n, v)) => (n, Some(v.to_string())),
                None => (name, None),
            };
            if with_value.contains(&name) {
                let v = match inline {
                    Some(v) => v,
                    None => it.next().with_context(|| format!("--{name} needs a value"))?.clone(),
                };
                if values.insert(name.to_string(), v).is_some() {
                    bail!("--{name} given twice");
                }
            } else if booleans.contains(&name) {
                if inline.is_some() {
                    bail!("--{name} takes no value");
                }
                flags.push(name.to_string());
            } else {
                bail!("unknown option --{name} (see --help)");
            }
        }
        Ok(Args { values, flags })
    }

    pub fn flag(&self, name: &str) -> bool {
        self.flags.iter().any(|f| f == name)
    }

    pub fn str(&self, name: &str) -> Option<&str> {
        self.values.get(name).map(String::as_str)
    }

    pub fn required(&self, name: &str) -> Result<&str> {
        self.str(name).with_context(|| format!("--{name} is required"))
    }

    /// A parsed value, or `default` when the option is absent.
    pub fn get<T: FromStr>(&self, name: &str, default: T) -> Result<T> {
        match self.values.get(name) {
            None => Ok(default),
            Some(v) => v.parse().map_err(|_| anyhow::anyhow!("--{name} {v:?} is not a valid {}", std::any::type_name::<T>())),
        }
    }
}
