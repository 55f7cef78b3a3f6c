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

impl Period {
    /// The period's nominal length, µs: a fixed window of this length is what a calendar
    /// period is to the scripts ([`Periods`]) and to a key's frame. A day of 24 hours, a
    /// week of 7 days, the Gregorian calendar's mean month (30.436875 days) and year
    /// (365.2425 days).
    pub fn nominal_us(self) -> i64 {
        const DAY: i64 = 86_400_000_000;
        match self {
            Period::Day => DAY,
            Period::Week => 7 * DAY,
            Period::Month => 2_629_746_000_000,
            Period::Year => 31_556_952_000_000,
        }
    }

    /// The longest a period of this kind lasts (an hour more than its longest civil
    /// length, for the clock change it may contain), µs.
    pub fn longest_us(self) -> i64 {
        const DAY: i64 = 86_400_000_000;
        const HOUR: i64 = 3_600_000_000;
        HOUR + match self {
            Period::Day => DAY,
            Period::Week => 7 * DAY,
            Period::Month => 31 * DAY,
            Period::Year => 366 * DAY,
        }
    }
}

/// How many periods a [`Periods`] table holds: the one before the current one, the
/// current one and the two after it.
pub const PERIODS_AROUND: usize = 4;

/// A calendar's periods around an instant, as a fixed window sees them: the window's
/// time is *period time*, where every period lasts its kind's nominal length `N` and
/// period `i` is `[i·N, (i+1)·N)`, mapped onto the real period linearly. A fixed window of
/// length `N` in period time counts per calendar period exactly: its slot is the
/// period's index and its window ends are the periods' real bounds. The scripts get this
/// table from quotad (`lua/helpers.lua`, `window_enter`) and map Redis's clock through it,
/// so Redis's clock picks the period; quotad computes the bounds.
///
/// Instants outside the table (a clock more than a period off, a debt owed beyond the
/// period after next) are mapped at the nominal length, one µs for one µs.
/// [`Periods::to_period_time`] and [`Periods::to_real`] use the same double arithmetic as
/// the scripts, so the two agree to the µs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Periods {
    /// The index of the table's first period.
    first: i64,
    /// The nominal length, µs.
    nominal_us: i64,
    /// The periods' bounds: period `first + k` is `[bounds[k], bounds[k + 1])`.
    bounds: [i64; PERIODS_AROUND + 1],
}

impl Calendar {
    /// The periods around `now_us`: the one before the period containing it, that period
    /// and the two after it.
    pub fn periods(&self, now_us: i64) -> Periods {
        let current = self.containing(now_us);
        let first = current.index - 1;
        let mut bounds = [0; PERIODS_AROUND + 1];
        bounds[0] = self.start_of(first);
        bounds[1] = current.start_us;
        bounds[2] = current.end_us;
        for (k, b) in bounds.iter_mut().enumerate().skip(3) {
            *b = self.start_of(first + k as i64);
        }
        Periods {
            first,
            nominal_us: self.period.nominal_us(),
            bounds,
        }
    }
}

impl Periods {
    /// Whether `now_us` is in the table's current period (the one it was built for).
    pub fn current_at(&self, now_us: i64) -> bool {
        self.bounds[1] <= now_us && now_us < self.bounds[2]
    }

    /// The real period containing `now_us` as the table knows it (`None`: outside it).
    pub fn span_at(&self, now_us: i64) -> Option<PeriodSpan> {
        (0..PERIODS_AROUND)
            .find(|&k| self.bounds[k] <= now_us && now_us < self.bounds[k + 1])
            .map(|k| PeriodSpan {
                index: self.first + k as i64,
                start_us: self.bounds[k],
                end_us: self.bounds[k + 1],
            })
    }

    /// The same periods moved by `by_us` (each starts `by_us` later): a boundary placed
    /// where a test wants one, seconds away, on a real clock.
    pub fn shifted(self, by_us: i64) -> Periods {
        Periods {
            bounds: self.bounds.map(|b| b + by_us),
            ..self
        }
    }

    /// The nominal length: the fixed window a calendar period is in period time.
    pub fn nominal_us(&self) -> i64 {
        self.nominal_us
    }

    /// The real instant `t` (µs since the epoch) in period time.
    pub fn to_period_time(&self, t: i64) -> i64 {
        let (n, b) = (self.nominal_us, &self.bounds);
        if t < b[0] {
            return (self.first * n).saturating_add(t - b[0]);
        }
        for k in 0..PERIODS_AROUND {
            if t < b[k + 1] {
                let into = ((t - b[k]) as f64 / (b[k + 1] - b[k]) as f64 * n as f64).floor();
                return (self.first + k as i64) * n + into as i64;
            }
        }
        ((self.first + PERIODS_AROUND as i64) * n).saturating_add(t - b[PERIODS_AROUND])
    }

    /// The real instant of period time `v`: a period's start in period time is the
    /// period's real start.
    pub fn to_real(&self, v: i64) -> i64 {
        let (n, b) = (self.nominal_us, &self.bounds);
        let k = v.div_euclid(n) - self.first;
        if k < 0 {
            return b[0].saturating_add(v - self.first * n);
        }
        if k >= PERIODS_AROUND as i64 {
            let last = (self.first + PERIODS_AROUND as i64) * n;
            return b[PERIODS_AROUND].saturating_add(v.saturating_sub(last));
        }
        let k = k as usize;
        let into = (v - (self.first + k as i64) * n) as f64 / n as f64 * (b[k + 1] - b[k]) as f64;
        b[k] + into.floor() as i64
    }

    /// The real time from `now_us` (real; `now_pt` in period time) until `after_us` of
    /// period time from `now_pt` has passed: a reset, retry or TTL in real µs, never
    /// negative.
    pub fn real_after(&self, now_us: i64, now_pt: i64, after_us: i64) -> i64 {
        (self.to_real(now_pt.saturating_add(after_us)) - now_us).max(0)
    }

    /// The table as a script's window argument (`lua/helpers.lua`, `window_enter`):
    /// `c<first>:<nominal>:<bound 0>:...:<bound 4>`.
    pub fn script_arg(&self) -> String {
        use std::fmt::Write;
        let mut s = format!("c{}:{}", self.first, self.nominal_us);
        for b in self.bounds {
            let _ = write!(s, ":{b}");
        }
        s
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
    fn period_time_maps_each_period_onto_its_real_bounds_and_keeps_order() {
        let mut x: u64 = 0x2545_F491_4F6C_DD1D;
        for zone in ["Europe/Berlin", "America/New_York", "Asia/Kathmandu"] {
            for period in Period::ALL {
                let c = Calendar::new(period, zone).unwrap();
                for _ in 0..200 {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let now = 1_600_000_000_000_000 + (x % 600_000_000_000_000) as i64;
                    let p = c.periods(now);
                    let n = period.nominal_us();
                    let s = c.containing(now);
                    assert!(p.current_at(now));
                    assert_eq!(p.span_at(now), Some(s));
                    // Every bound in the table is a period's start in period time.
                    for k in -1..=3 {
                        let b = c.span(s.index + k).start_us;
                        assert_eq!(p.to_period_time(b), (s.index + k) * n, "{zone} {period:?}");
                        assert_eq!(p.to_real((s.index + k) * n), b, "{zone} {period:?}");
                    }
                    // Inside a period: in order, and back to within a µs of itself.
                    let (a, b) = (now, now + (x % 1000) as i64);
                    assert!(p.to_period_time(a) <= p.to_period_time(b));
                    let back = p.to_real(p.to_period_time(now));
                    assert!((now - 2..=now).contains(&back), "{now} -> {back}");
                    assert_eq!(p.to_period_time(now).div_euclid(n), s.index);
                }
                // Outside the table: a µs for a µs.
                let (p, n) = (c.periods(0), period.nominal_us());
                let first = c.containing(0).index - 1;
                let before = c.span(first).start_us;
                assert_eq!(p.to_period_time(before - 5), first * n - 5);
                assert_eq!(p.to_real(first * n - 5), before - 5);
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
