//! Calendar periods: which day, week, month or year of a time zone an instant falls in,
//! and where that period starts and ends. Periods follow the calendar in the zone: a month
//! is 28 to 31 days, a day 23 or 25 hours when the clocks change, February 29 exists in
//! leap years. Weeks start on Monday (ISO 8601).
//!
//! A period is numbered from the one containing 1970-01-01 in the zone (index 0), so the
//! number of periods between two instants is a difference of indices, whatever their
//! lengths. The time-zone rules are the IANA database bundled with jiff (no file is read).

use std::fmt;

use jiff::Timestamp;
use jiff::civil::{self, Date};
use jiff::tz::TimeZone;

/// A calendar period's kind (a policy's `window`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Period {
    /// From midnight to midnight.
    Day,
    /// From Monday's midnight to the next Monday's.
    Week,
    /// From the first of a month's midnight to the next month's.
    Month,
    /// From January 1's midnight to the next year's.
    Year,
}

impl Period {
    /// Every period, shortest first.
    pub const ALL: [Period; 4] = [Period::Day, Period::Week, Period::Month, Period::Year];

    /// The config's name of it.
    pub fn name(self) -> &'static str {
        match self {
            Period::Day => "day",
            Period::Week => "week",
            Period::Month => "month",
            Period::Year => "year",
        }
    }

    /// The period named `name` in a config.
    pub fn named(name: &str) -> Option<Period> {
        Period::ALL.into_iter().find(|p| p.name() == name)
    }
}

/// A time-zone name the bundled database does not know.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownZone(pub String);

impl fmt::Display for UnknownZone {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "unknown time zone {:?}: use an IANA name such as \"Europe/Berlin\" or \"UTC\"",
            self.0
        )
    }
}

impl std::error::Error for UnknownZone {}

/// One period: its index and its bounds, µs since the Unix epoch (`start_us` in it,
/// `end_us` the next one's start).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeriodSpan {
    /// Periods since the one containing 1970-01-01 in the zone.
    pub index: i64,
    /// Its first instant.
    pub start_us: i64,
    /// The next period's first instant.
    pub end_us: i64,
}

/// Periods of one kind in one time zone.
#[derive(Debug, Clone)]
pub struct Calendar {
    period: Period,
    zone: TimeZone,
    zone_name: String,
}

impl PartialEq for Calendar {
    fn eq(&self, other: &Self) -> bool {
        self.period == other.period && self.zone_name == other.zone_name
    }
}

impl Eq for Calendar {}

/// The first day of the epoch's period: 1970-01-01 was a Thursday, so the epoch's week
/// started on Monday 1969-12-29.
const EPOCH: Date = civil::date(1970, 1, 1);
const EPOCH_WEEKDAY_OFFSET: i64 = 3;

impl Calendar {
    /// Periods of `period` in the IANA time zone `zone`.
    pub fn new(period: Period, zone: &str) -> Result<Calendar, UnknownZone> {
        let tz = jiff::tz::db()
            .get(zone)
            .map_err(|_| UnknownZone(zone.to_owned()))?;
        Ok(Calendar {
            period,
            zone: tz,
            zone_name: zone.to_owned(),
        })
    }

    /// The kind of period.
    pub fn period(&self) -> Period {
        self.period
    }

    /// The time zone's name, as given.
    pub fn zone(&self) -> &str {
        &self.zone_name
    }

    /// The period containing `now_us` (µs since the Unix epoch).
    pub fn containing(&self, now_us: i64) -> PeriodSpan {
        let date = Timestamp::from_microsecond(now_us)
            .unwrap_or(Timestamp::UNIX_EPOCH)
            .to_zoned(self.zone.clone())
            .date();
        let index = self.index_of(date);
        // A rule change can move a midnight across `now`: the neighbour then holds it.
        let span = self.span(index);
        if now_us < span.start_us {
            self.span(index - 1)
        } else if now_us >= span.end_us {
            self.span(index + 1)
        } else {
            span
        }
    }

    /// The period of index `index`.
    pub fn span(&self, index: i64) -> PeriodSpan {
        PeriodSpan {
            index,
            start_us: self.start_of(index),
            end_us: self.start_of(index + 1),
        }
    }

    /// The index of the period containing the civil date `date`.
    fn index_of(&self, date: Date) -> i64 {
        match self.period {
            Period::Day => days_since_epoch(date),
            Period::Week => (days_since_epoch(date) + EPOCH_WEEKDAY_OFFSET).div_euclid(7),
            Period::Month => (i64::from(date.year()) - 1970) * 12 + i64::from(date.month()) - 1,
            Period::Year => i64::from(date.year()) - 1970,
        }
    }

    /// The first instant (µs) of the period of index `index`: its first day's first
    /// instant in the zone (midnight, or the first time that exists after it).
    fn start_of(&self, index: i64) -> i64 {
        let first = match self.period {
            Period::Day => add_days(EPOCH, index),
            Period::Week => add_days(EPOCH, index * 7 - EPOCH_WEEKDAY_OFFSET),
            Period::Month => {
                let year = 1970 + index.div_euclid(12);
                let month = index.rem_euclid(12) + 1;
                civil::Date::new(clamp_year(year), month as i8, 1).unwrap_or(EPOCH)
            }
            Period::Year => civil::Date::new(clamp_year(1970 + index), 1, 1).unwrap_or(EPOCH),
        };
        first
            .to_zoned(self.zone.clone())
            .and_then(|z| z.start_of_day())
            .map(|z| z.timestamp().as_microsecond())
            .unwrap_or(i64::MAX)
    }
}

/// Civil days from 1970-01-01 to `date`.
fn days_since_epoch(date: Date) -> i64 {
    EPOCH
        .until((jiff::Unit::Day, date))
        .map(|s| i64::from(s.get_days()))
        .unwrap_or(0)
}

/// `date` moved by `days` civil days (within jiff's range of years).
fn add_days(date: Date, days: i64) -> Date {
    let days = days.clamp(-3_000_000, 2_900_000);
    date.checked_add(jiff::Span::new().days(days))
        .unwrap_or(date)
}

/// A year within jiff's range.
fn clamp_year(year: i64) -> i16 {
    year.clamp(-9999, 9999) as i16
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOUR_US: i64 = 3_600_000_000;
    const DAY_US: i64 = 24 * HOUR_US;

    /// µs of the civil instant `y-m-d h:mi` in `zone`.
    fn at(zone: &str, y: i16, m: i8, d: i8, h: i8, mi: i8) -> i64 {
        civil::date(y, m, d)
            .at(h, mi, 0, 0)
            .to_zoned(jiff::tz::db().get(zone).unwrap())
            .unwrap()
            .timestamp()
            .as_microsecond()
    }

    fn length(c: &Calendar, now: i64) -> i64 {
        let s = c.containing(now);
        s.end_us - s.start_us
    }

    #[test]
    fn a_day_is_23_or_25_hours_when_the_clocks_change() {
        for (zone, spring, autumn) in [
            ("America/New_York", (2026, 3, 8), (2026, 11, 1)),
            ("Europe/Berlin", (2026, 3, 29), (2026, 10, 25)),
        ] {
            let days = Calendar::new(Period::Day, zone).unwrap();
            let noon = |(y, m, d)| at(zone, y, m, d, 12, 0);
            assert_eq!(length(&days, noon(spring)), 23 * HOUR_US, "{zone} spring");
            assert_eq!(length(&days, noon(autumn)), 25 * HOUR_US, "{zone} autumn");
            let before = (spring.0, spring.1, spring.2 - 1);
            assert_eq!(length(&days, noon(before)), DAY_US, "{zone} the day before");
            // Midnight local is where the day starts, whatever the offset.
            let s = days.containing(noon(autumn));
            assert_eq!(s.start_us, at(zone, autumn.0, autumn.1, autumn.2, 0, 0));
        }
    }

    #[test]
    fn months_follow_the_calendar_and_february_29_exists_in_leap_years() {
        let utc = Calendar::new(Period::Month, "UTC").unwrap();
        assert_eq!(length(&utc, at("UTC", 2028, 2, 29, 23, 59)), 29 * DAY_US);
        assert_eq!(length(&utc, at("UTC", 2027, 2, 14, 0, 0)), 28 * DAY_US);
        // November (30 days, and the autumn hour in New York), then December (31).
        let ny = Calendar::new(Period::Month, "America/New_York").unwrap();
        let nov = ny.containing(at("America/New_York", 2026, 11, 30, 23, 59));
        let dec = ny.containing(at("America/New_York", 2026, 12, 1, 0, 0));
        assert_eq!(nov.end_us - nov.start_us, 30 * DAY_US + HOUR_US);
        assert_eq!(dec.end_us - dec.start_us, 31 * DAY_US);
        assert_eq!((dec.index, dec.start_us), (nov.index + 1, nov.end_us));
    }

    #[test]
    fn a_year_ends_at_local_midnight_on_december_31() {
        let tokyo = Calendar::new(Period::Year, "Asia/Tokyo").unwrap();
        let new_year = at("Asia/Tokyo", 2027, 1, 1, 0, 0);
        let last = tokyo.containing(new_year - 1);
        let first = tokyo.containing(new_year);
        assert_eq!((last.end_us, first.start_us), (new_year, new_year));
        assert_eq!((last.index, first.index), (56, 57));
        assert_eq!(last.end_us - last.start_us, 365 * DAY_US);
    }

    #[test]
    fn a_week_starts_on_monday() {
        let weeks = Calendar::new(Period::Week, "Europe/Berlin").unwrap();
        // Wednesday 2026-12-09: the week of Monday 2026-12-07.
        let s = weeks.containing(at("Europe/Berlin", 2026, 12, 9, 15, 0));
        assert_eq!(s.start_us, at("Europe/Berlin", 2026, 12, 7, 0, 0));
        assert_eq!(s.end_us, at("Europe/Berlin", 2026, 12, 14, 0, 0));
        // The epoch's week (Monday 1969-12-29 to Monday 1970-01-05) is number 0.
        let utc = Calendar::new(Period::Week, "UTC").unwrap();
        assert_eq!(utc.containing(0).index, 0);
        assert_eq!(utc.containing(0).start_us, -3 * DAY_US);
    }

    #[test]
    fn every_instant_is_in_exactly_one_period_and_periods_follow_each_other() {
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        for zone in [
            "UTC",
            "America/New_York",
            "Europe/Berlin",
            "Australia/Lord_Howe",
            "Asia/Kathmandu",
        ] {
            for period in Period::ALL {
                let c = Calendar::new(period, zone).unwrap();
                for _ in 0..400 {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    // Instants from 1960 to 2080.
                    let now = -315_619_200_000_000 + (x % 3_786_912_000_000_000) as i64;
                    let s = c.containing(now);
                    assert!(
                        s.start_us <= now && now < s.end_us,
                        "{zone} {period:?} {now}: {s:?}"
                    );
                    assert_eq!(c.span(s.index), s);
                    assert_eq!(c.containing(s.end_us).index, s.index + 1);
                    assert_eq!(c.containing(s.end_us - 1).index, s.index);
                    assert_eq!(c.span(s.index + 1).start_us, s.end_us);
                }
            }
        }
    }

    #[test]
    fn an_unknown_zone_is_refused_by_name() {
        let e = Calendar::new(Period::Month, "Mars/Olympus_Mons").unwrap_err();
        assert!(e.to_string().contains("Mars/Olympus_Mons"), "{e}");
        assert_eq!(Period::named("month"), Some(Period::Month));
        assert_eq!(Period::named("fortnight"), None);
    }
}
